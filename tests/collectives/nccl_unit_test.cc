// The nccl backend without a GPU: the unique id exchange through the store,
// argument checks, the error mapping, and the completion / abort-on-timeout
// logic driven through a replaced Api (a stalled stream, asynchronous NCCL
// errors) instead of a device.

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "collectives/nccl/nccl_backend.h"
#include "collectives/nccl/nccl_internal.h"
#include "collectives/process_group.h"
#include "common/error.h"
#include "store/hash_store.h"

namespace dist = ctorchrun::dist;
namespace detail = ctorchrun::dist::nccl_detail;
using std::chrono::milliseconds;

namespace {

// Stands in for NCCL and CUDA: an event that completes after `ready_after`
// queries (never when negative), an async error state, counted aborts; a
// current device per thread and the devices with a primary context; a log of
// the calls (all but the polls), naming streams (S1.. created by the backend,
// "legacy" for cudaStreamLegacy, U1.. for the tests' own) and events (E1..);
// and a check that no two calls are inside the communicator at once and none
// comes after its abort, with a hook that runs inside those calls.
class FakeApi : public detail::Api {
 public:
  cudaError_t get_device_count(int* count) override {
    *count = devices;
    return cudaSuccess;
  }
  cudaError_t get_device(int* device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    *device = current_[std::this_thread::get_id()];  // 0 until set, as CUDA's
    return cudaSuccess;
  }
  cudaError_t set_device(int device) override {
    if (device < 0 || device >= devices) return cudaErrorInvalidDevice;
    std::lock_guard<std::mutex> lock(mutex_);
    current_[std::this_thread::get_id()] = device;
    contexts_.insert(device);  // since CUDA 12 cudaSetDevice makes the primary context
    log_locked("set_device(" + std::to_string(device) + ")");
    return cudaSuccess;
  }
  cudaError_t primary_context_active(int device, bool* active) override {
    std::lock_guard<std::mutex> lock(mutex_);
    *active = contexts_.count(device) > 0;
    return cudaSuccess;
  }
  cudaError_t stream_create(cudaStream_t* stream) override {
    std::lock_guard<std::mutex> lock(mutex_);
    *stream = reinterpret_cast<cudaStream_t>(uintptr_t{0x1000} + ++streams_);
    log_locked("stream_create(" + name(*stream) + ")");
    return cudaSuccess;
  }
  cudaError_t stream_destroy(cudaStream_t stream) override {
    log("stream_destroy(" + name(stream) + ")");
    return cudaSuccess;
  }
  cudaError_t stream_wait_event(cudaStream_t stream, cudaEvent_t event) override {
    log("stream_wait_event(" + name(stream) + "," + name(event) + ")");
    return cudaSuccess;
  }
  cudaError_t device_malloc(void** data, size_t) override {
    *data = &device_memory_;
    log("device_malloc");
    return cudaSuccess;
  }
  cudaError_t device_free(void*) override {
    log("device_free");
    return cudaSuccess;
  }
  cudaError_t memcpy_async(void*, const void*, size_t, cudaStream_t stream) override {
    log("memcpy_async(" + name(stream) + ")");
    return cudaSuccess;
  }
  cudaError_t event_create(cudaEvent_t* event) override {
    std::lock_guard<std::mutex> lock(mutex_);
    *event = reinterpret_cast<cudaEvent_t>(uintptr_t{0x2000} + ++events_);
    log_locked("event_create(" + name(*event) + ")");
    return cudaSuccess;
  }
  cudaError_t event_record(cudaEvent_t event, cudaStream_t stream) override {
    log("event_record(" + name(event) + "," + name(stream) + ")");
    return cudaSuccess;
  }
  cudaError_t event_query(cudaEvent_t) override {
    ++queries;
    if (event_error != cudaSuccess) return event_error;
    if (ready_after < 0 || queries <= ready_after) return cudaErrorNotReady;
    return cudaSuccess;
  }
  cudaError_t event_destroy(cudaEvent_t event) override {
    ++destroyed;
    log("event_destroy(" + name(event) + ")");
    return cudaSuccess;
  }

  ncclResult_t get_unique_id(ncclUniqueId* id) override {
    for (size_t i = 0; i < sizeof id->internal; ++i) id->internal[i] = static_cast<char>(i * 7 + 3);
    ++ids;
    return id_result;
  }
  ncclResult_t comm_init_rank(ncclComm_t* comm, int, ncclUniqueId, int, ncclConfig_t*) override {
    *comm = reinterpret_cast<ncclComm_t>(uintptr_t{0x3000});
    log("comm_init_rank");
    return init_result;  // in progress: non-blocking, done when the async error says so
  }
  ncclResult_t comm_get_async_error(ncclComm_t comm, ncclResult_t* error) override {
    Inside inside(*this, comm, "comm_get_async_error");
    ++async_queries;
    *error =
        (in_progress_for < 0 || async_queries <= in_progress_for) ? ncclInProgress : async_error;
    if (in_progress_for == 0) *error = async_error;
    return ncclSuccess;
  }
  ncclResult_t comm_finalize(ncclComm_t comm) override {
    Inside inside(*this, comm, "comm_finalize");
    return ncclSuccess;
  }
  ncclResult_t comm_destroy(ncclComm_t comm) override {
    Inside inside(*this, comm, "comm_destroy");
    return ncclSuccess;
  }
  ncclResult_t comm_abort(ncclComm_t comm) override {
    Inside inside(*this, comm, "comm_abort");
    ++aborts;
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_.insert(comm);
    return ncclSuccess;
  }
  ncclResult_t group_start() override {
    log("group_start");
    return ncclSuccess;
  }
  ncclResult_t group_end() override {
    log("group_end");
    return ncclSuccess;
  }
  ncclResult_t all_reduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t comm,
                          cudaStream_t stream) override {
    return collective("all_reduce", comm, stream);
  }
  ncclResult_t broadcast(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t comm,
                         cudaStream_t stream) override {
    return collective("broadcast", comm, stream);
  }
  ncclResult_t reduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t comm,
                      cudaStream_t stream) override {
    return collective("reduce", comm, stream);
  }
  ncclResult_t all_gather(const void*, void*, size_t, ncclDataType_t, ncclComm_t comm,
                          cudaStream_t stream) override {
    return collective("all_gather", comm, stream);
  }
  ncclResult_t reduce_scatter(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                              ncclComm_t comm, cudaStream_t stream) override {
    return collective("reduce_scatter", comm, stream);
  }
  ncclResult_t send(const void*, size_t, ncclDataType_t, int, ncclComm_t comm,
                    cudaStream_t stream) override {
    return collective("send", comm, stream);
  }
  ncclResult_t recv(void*, size_t, ncclDataType_t, int, ncclComm_t comm,
                    cudaStream_t stream) override {
    return collective("recv", comm, stream);
  }

  // The calls so far, in order.
  std::vector<std::string> calls() {
    std::lock_guard<std::mutex> lock(mutex_);
    return log_;
  }
  // This thread's current device (0 until set, as CUDA's).
  int device() {
    int d = -1;
    get_device(&d);
    return d;
  }
  bool has_context(int device) {
    bool active = false;
    primary_context_active(device, &active);
    return active;
  }

  static std::string name(cudaStream_t stream) {
    const auto v = reinterpret_cast<uintptr_t>(stream);
    if (stream == cudaStreamLegacy) return "legacy";
    if (v >= 0x1000 && v < 0x2000) return "S" + std::to_string(v - 0x1000);
    if (v >= 0x7000 && v < 0x8000) return "U" + std::to_string(v - 0x7000);
    return "stream" + std::to_string(v);
  }
  static std::string name(cudaEvent_t event) {
    const auto v = reinterpret_cast<uintptr_t>(event);
    if (v >= 0x2000 && v < 0x3000) return "E" + std::to_string(v - 0x2000);
    return "event" + std::to_string(v);
  }

  int devices = 2;
  int ready_after = -1;
  int in_progress_for = 0;
  ncclResult_t async_error = ncclSuccess;
  cudaError_t event_error = cudaSuccess;
  ncclResult_t id_result = ncclSuccess;
  ncclResult_t init_result = ncclInProgress;
  // Runs inside every call that uses the communicator, with the call's name.
  std::function<void(const std::string&)> hook;
  std::atomic<int> ids{0}, queries{0}, async_queries{0}, aborts{0}, destroyed{0};
  // Calls that entered the communicator while another was inside it, and
  // calls that came after its abort.
  std::atomic<int> concurrent{0}, after_abort{0};

 private:
  // A call inside the communicator: counted, checked, logged (but the polls).
  class Inside {
   public:
    Inside(FakeApi& api, ncclComm_t comm, const std::string& call) : api_(api) {
      {
        std::lock_guard<std::mutex> lock(api.mutex_);
        if (api.inside_++ > 0) ++api.concurrent;
        if (api.aborted_.count(comm) > 0) ++api.after_abort;
        if (call != "comm_get_async_error") api.log_locked(call);
      }
      if (api.hook) api.hook(call);
    }
    ~Inside() {
      std::lock_guard<std::mutex> lock(api_.mutex_);
      --api_.inside_;
    }
    Inside(const Inside&) = delete;
    Inside& operator=(const Inside&) = delete;

   private:
    FakeApi& api_;
  };

  ncclResult_t collective(const std::string& call, ncclComm_t comm, cudaStream_t stream) {
    Inside inside(*this, comm, call + "(" + name(stream) + ")");
    return ncclSuccess;
  }
  void log(const std::string& call) {
    std::lock_guard<std::mutex> lock(mutex_);
    log_locked(call);
  }
  void log_locked(const std::string& call) { log_.push_back(call); }

  std::mutex mutex_;
  std::vector<std::string> log_;
  std::map<std::thread::id, int> current_;
  std::set<int> contexts_;
  std::set<ncclComm_t> aborted_;
  int inside_ = 0;
  uintptr_t streams_ = 0, events_ = 0;
  float device_memory_ = 0;
};

// Replaces the process's Api while alive.
class UseApi {
 public:
  explicit UseApi(detail::Api& api) : previous_(detail::replace_api(&api)) {}
  ~UseApi() { detail::replace_api(previous_); }
  UseApi(const UseApi&) = delete;
  UseApi& operator=(const UseApi&) = delete;

 private:
  detail::Api* previous_;
};

// A backend of one rank on cuda:`device`, made through `api`.
std::unique_ptr<dist::Backend> fake_backend(FakeApi& api, int device = 0) {
  UseApi use(api);
  dist::BackendContext context;
  context.store = std::make_shared<ctorchrun::store::HashStore>();
  context.device = {dist::DeviceType::kCuda, device};
  context.timeout = milliseconds(20000);
  return dist::create_nccl_backend(context);
}

dist::Op all_reduce_op(float* data, size_t count, int device,
                       milliseconds timeout = milliseconds(20000)) {
  dist::Op op;
  op.type = dist::OpType::kAllReduce;
  op.output =
      dist::Buffer{data, count, dist::DataType::kFloat32, {dist::DeviceType::kCuda, device}};
  op.timeout = timeout;
  return op;
}

// The position of the first call at or after `from` matching `pattern`
// (std::regex, whole call), its submatches in `match`; -1 when none.
long find_call(const std::vector<std::string>& calls, const std::string& pattern, long from = 0,
               std::smatch* match = nullptr) {
  const std::regex re(pattern);
  for (auto i = static_cast<size_t>(std::max(from, 0L)); i < calls.size(); ++i) {
    std::smatch m;
    if (std::regex_match(calls[i], m, re)) {
      if (match != nullptr) *match = m;
      return static_cast<long>(i);
    }
  }
  return -1;
}

std::string joined(const std::vector<std::string>& calls) {
  std::string all;
  for (const auto& c : calls) all += c + "\n";
  return all;
}

const cudaEvent_t kEvent = reinterpret_cast<cudaEvent_t>(uintptr_t{1});
const cudaStream_t kStream = reinterpret_cast<cudaStream_t>(uintptr_t{0x1001});

}  // namespace

TEST_CASE("nccl id exchange: rank 0's unique id reaches every rank through the store", "[unit]") {
  FakeApi api;
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  std::vector<ncclUniqueId> ids(4);
  std::vector<std::thread> ranks;
  for (int r = 3; r >= 0; --r) {  // readers start first and wait for rank 0
    ranks.emplace_back([&, r] {
      ids[static_cast<size_t>(r)] = detail::exchange_unique_id(api, *store, r, milliseconds(20000));
    });
  }
  for (auto& t : ranks) t.join();
  CHECK(api.ids == 1);
  for (const auto& id : ids) {
    CHECK(std::memcmp(id.internal, ids[0].internal, sizeof id.internal) == 0);
  }
  CHECK(ids[0].internal[1] == 10);
  CHECK(store->get("nccl_unique_id").size() == sizeof(ncclUniqueId));
}

TEST_CASE("nccl id exchange: a missing rank 0 times out, a malformed id is refused", "[unit]") {
  FakeApi api;
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  CHECK_THROWS_WITH(detail::exchange_unique_id(api, *store, 1, milliseconds(50)),
                    Catch::Contains("rank 0's unique id") && Catch::Contains("nccl_unique_id"));
  CHECK_THROWS_AS(detail::exchange_unique_id(api, *store, 1, milliseconds(50)),
                  ctorchrun::TimeoutError);
  store->set("nccl_unique_id", "short");
  CHECK_THROWS_AS(detail::exchange_unique_id(api, *store, 1, milliseconds(50)),
                  ctorchrun::ProtocolError);
  api.id_result = ncclSystemError;
  CHECK_THROWS_AS(detail::exchange_unique_id(api, *store, 0, milliseconds(50)), ctorchrun::IoError);
}

TEST_CASE("nccl errors: NCCL and CUDA results map to the library's error types", "[unit]") {
  auto kind = [](std::exception_ptr error) -> std::string {
    try {
      std::rethrow_exception(error);
    } catch (const ctorchrun::ConfigError& e) {
      return std::string("config: ") + e.what();
    } catch (const ctorchrun::IoError& e) {
      return std::string("io: ") + e.what();
    } catch (...) {
      return "other";
    }
  };
  CHECK_THAT(kind(detail::nccl_error(ncclInvalidArgument, "all_reduce")),
             Catch::StartsWith("config: nccl: all_reduce: "));
  CHECK_THAT(kind(detail::nccl_error(ncclInvalidUsage, "x")), Catch::StartsWith("config: "));
  for (ncclResult_t r :
       {ncclSystemError, ncclRemoteError, ncclUnhandledCudaError, ncclInternalError}) {
    INFO(r);
    CHECK_THAT(kind(detail::nccl_error(r, "broadcast")), Catch::StartsWith("io: nccl: broadcast"));
  }
  CHECK_THAT(kind(detail::nccl_error(ncclRemoteError, "x")),
             Catch::Contains(ncclGetErrorString(ncclRemoteError)));
  for (cudaError_t r : {cudaErrorNoDevice, cudaErrorInsufficientDriver, cudaErrorInvalidDevice}) {
    INFO(int(r));
    CHECK_THAT(kind(detail::cuda_error(r, "cudaSetDevice")), Catch::StartsWith("config: "));
  }
  CHECK_THAT(
      kind(detail::cuda_error(cudaErrorLaunchFailure, "all_gather")),
      Catch::StartsWith("io: nccl: all_gather") && Catch::Contains("cudaErrorLaunchFailure"));
}

TEST_CASE("nccl argument checks: wrong devices and ranks are ConfigErrors before CUDA", "[unit]") {
  dist::register_nccl_backend();
  dist::BackendContext context;
  context.store = std::make_shared<ctorchrun::store::HashStore>();
  context.timeout = milliseconds(1000);
  context.device = {};  // CPU
  CHECK_THROWS_WITH(dist::create_backend("nccl", context),
                    Catch::Contains("CUDA devices") && Catch::Contains("cpu"));
  context.device = {dist::DeviceType::kCuda, 0};
  context.rank = 2;
  context.size = 2;
  CHECK_THROWS_AS(dist::create_backend("nccl", context), ctorchrun::ConfigError);
  // No such device: on a machine without a GPU the device count itself fails.
  context.rank = 0;
  context.device = {dist::DeviceType::kCuda, 9999};
  CHECK_THROWS_AS(dist::create_backend("nccl", context), ctorchrun::ConfigError);
  CHECK(context.store->check({"nccl_unique_id"}) == false);  // refused before the exchange

  // Through init_process_group: the backend name is known, the CPU device refused.
  dist::InitOptions options;
  options.backend = "nccl";
  options.rank = 0;
  options.world_size = 1;
  options.restart_count = 0;
  options.store = std::make_shared<ctorchrun::store::HashStore>();
  options.timeout = milliseconds(1000);
  CHECK_THROWS_AS(dist::init_process_group(options), ctorchrun::ConfigError);
  CHECK(dist::kNcclDefaultTimeout == milliseconds(10 * 60 * 1000));
}

TEST_CASE("nccl timeout: a stalled op aborts the communicator and throws TimeoutError", "[unit]") {
  FakeApi api;  // the event never completes: a stalled stream
  detail::Communicator comm(api, nullptr);
  const auto start = detail::Clock::now();
  CHECK_THROWS_AS(detail::await(comm, kEvent, start + milliseconds(30),
                                detail::Clock::time_point::max(), milliseconds(30), "all_reduce"),
                  ctorchrun::TimeoutError);
  CHECK(api.aborts == 1);
  CHECK(comm.aborted());
  CHECK(api.queries > 0);
  // The group is then unusable: later waits fail at once, without a second abort.
  CHECK_THROWS_WITH(detail::await(comm, kEvent, detail::Clock::time_point::max(),
                                  detail::Clock::time_point::max(), milliseconds(30), "barrier"),
                    Catch::Contains("aborted"));
  CHECK(api.aborts == 1);
}

TEST_CASE("nccl timeout: the message names the op and the timeout", "[unit]") {
  FakeApi api;
  detail::Communicator comm(api, nullptr);
  CHECK_THROWS_WITH(
      detail::await(comm, kEvent, detail::Clock::now() + milliseconds(20),
                    detail::Clock::time_point::max(), milliseconds(20), "broadcast on rank 0/1"),
      Catch::Contains("broadcast on rank 0/1") && Catch::Contains("20 ms") &&
          Catch::Contains("aborted"));
}

TEST_CASE("nccl wait: giving up early leaves the communicator running", "[unit]") {
  FakeApi api;
  detail::Communicator comm(api, nullptr);
  const auto now = detail::Clock::now();
  CHECK_THROWS_AS(detail::await(comm, kEvent, now + std::chrono::hours(1), now + milliseconds(20),
                                milliseconds(3600000), "all_gather"),
                  ctorchrun::TimeoutError);
  CHECK(api.aborts == 0);
  CHECK_FALSE(comm.aborted());
  api.ready_after = api.queries + 3;  // the stream catches up
  detail::await(comm, kEvent, now + std::chrono::hours(1), detail::Clock::time_point::max(),
                milliseconds(3600000), "all_gather");
  CHECK(api.aborts == 0);
}

TEST_CASE("nccl work: wait(timeout) gives up early, the op's own timeout aborts", "[unit]") {
  FakeApi api;  // a stalled stream
  auto comm = std::make_shared<detail::Communicator>(api, nullptr);
  {
    detail::EventWork work(comm, kEvent, 0, kStream, milliseconds(200), "all_reduce on rank 0/1");
    CHECK_FALSE(work.is_completed());
    CHECK_THROWS_WITH(work.wait(milliseconds(10)), Catch::Contains("gave up"));
    CHECK(api.aborts == 0);
    // Even so, the caller's (legacy) stream is ordered after the op.
    CHECK(find_call(api.calls(), R"(stream_wait_event\(legacy,event1\))") >= 0);
    CHECK_THROWS_WITH(work.wait(), Catch::Contains("within 200 ms"));
    CHECK(api.aborts == 1);
    CHECK(work.is_completed());
    CHECK_THROWS_AS(work.wait(), ctorchrun::TimeoutError);  // the same error again
    CHECK(api.aborts == 1);
  }
  CHECK(api.destroyed == 1);
  // Ops started after the abort fail at once.
  detail::EventWork later(comm, kEvent, 0, kStream, milliseconds(100000), "barrier on rank 0/1");
  CHECK_THROWS_AS(later.wait(), ctorchrun::IoError);
}

TEST_CASE("nccl work: a completed event completes the work", "[unit]") {
  FakeApi api;
  api.ready_after = 2;
  auto comm = std::make_shared<detail::Communicator>(api, nullptr);
  detail::EventWork work(comm, kEvent, 0, kStream, milliseconds(100000), "broadcast on rank 0/1");
  work.wait();
  CHECK(work.is_completed());
  CHECK(api.aborts == 0);
}

TEST_CASE("nccl errors: an asynchronous NCCL error aborts and surfaces as IoError", "[unit]") {
  FakeApi api;
  api.async_error = ncclRemoteError;  // a peer died
  detail::Communicator comm(api, nullptr);
  CHECK_THROWS_AS(detail::await(comm, kEvent, detail::Clock::time_point::max(),
                                detail::Clock::time_point::max(), milliseconds(1), "send"),
                  ctorchrun::IoError);
  CHECK(api.aborts == 1);

  FakeApi failing;  // the stream itself failed
  failing.event_error = cudaErrorLaunchFailure;
  detail::Communicator comm2(failing, nullptr);
  CHECK_THROWS_AS(detail::await(comm2, kEvent, detail::Clock::time_point::max(),
                                detail::Clock::time_point::max(), milliseconds(1), "recv"),
                  ctorchrun::IoError);
  CHECK(failing.aborts == 1);
}

TEST_CASE("nccl set-up: in-progress calls are polled until done or aborted", "[unit]") {
  FakeApi api;
  api.in_progress_for = 3;  // a non-blocking ncclCommInitRankConfig finishing
  detail::Communicator comm(api, nullptr);
  detail::await(comm, nullptr, detail::Clock::time_point::max(), detail::Clock::time_point::max(),
                milliseconds(1000), "communicator set-up");
  CHECK(api.async_queries == 4);
  CHECK(api.aborts == 0);

  FakeApi stuck;
  stuck.in_progress_for = -1;  // a rank never joins
  detail::Communicator comm2(stuck, nullptr);
  CHECK_THROWS_AS(
      detail::await(comm2, nullptr, detail::Clock::now() + milliseconds(20),
                    detail::Clock::time_point::max(), milliseconds(20), "communicator set-up"),
      ctorchrun::TimeoutError);
  CHECK(stuck.aborts == 1);
}

TEST_CASE("nccl api: the replaced Api is the one backends use", "[unit]") {
  FakeApi api;
  detail::Api* previous = detail::replace_api(&api);
  CHECK(&detail::api() == &api);
  detail::replace_api(previous);
  CHECK(&detail::api() != &api);
}

namespace {

class RecordingBackend : public dist::Backend {
 public:
  std::string name() const override { return "nccl"; }
  dist::WorkHandle run(const dist::Op&, bool) override { return nullptr; }
};

}  // namespace

TEST_CASE("nccl timeout: groups default to 10 minutes, an explicit timeout wins", "[unit]") {
  dist::register_backend("nccl", [](const dist::BackendContext& context) {
    CHECK(context.timeout <= dist::kNcclDefaultTimeout);
    return std::make_unique<RecordingBackend>();
  });
  dist::InitOptions options;
  options.backend = "nccl";
  options.rank = 0;
  options.world_size = 1;
  options.restart_count = 0;
  options.store = std::make_shared<ctorchrun::store::HashStore>();
  auto pg = dist::init_process_group(options);
  CHECK(pg->timeout() == milliseconds(10 * 60 * 1000));
  options.timeout = milliseconds(1234);
  CHECK(dist::init_process_group(options)->timeout() == milliseconds(1234));
  options.backend = "gloo";
  options.timeout = dist::kDefaultTimeout;
  CHECK(dist::init_process_group(options)->timeout() == milliseconds(30 * 60 * 1000));
  dist::register_nccl_backend();
}

TEST_CASE("nccl streams: StreamGuard sets this thread's stream and nests", "[unit]") {
  auto* first = reinterpret_cast<CUstream_st*>(uintptr_t{0x10});
  auto* second = reinterpret_cast<CUstream_st*>(uintptr_t{0x20});
  CHECK(dist::current_stream_override() == nullptr);
  {
    dist::StreamGuard outer(first);
    CHECK(dist::current_stream_override() == first);
    {
      dist::StreamGuard inner(second);
      CHECK(dist::current_stream_override() == second);
      CUstream_st* seen_elsewhere = first;
      std::thread([&] { seen_elsewhere = dist::current_stream_override(); }).join();
      CHECK(seen_elsewhere == nullptr);  // per thread
    }
    CHECK(dist::current_stream_override() == first);
  }
  CHECK(dist::current_stream_override() == nullptr);
}

TEST_CASE("nccl backend api: set-up, an all_reduce and tear-down go through the Api", "[unit]") {
  FakeApi api;
  api.ready_after = 0;  // every event completes at once
  float data[4] = {};
  {
    auto backend = fake_backend(api, 1);
    REQUIRE(backend != nullptr);
    CHECK(backend->name() == "nccl");
    auto work = backend->run(all_reduce_op(data, 4, 1), /*async=*/false);
    REQUIRE(work != nullptr);
    CHECK(work->is_completed());
  }
  const auto calls = api.calls();
  INFO(joined(calls));
  // Set-up: the device, the group's stream, the scratch float, the communicator.
  long at = find_call(calls, R"(set_device\(1\))");
  at = find_call(calls, R"(stream_create\(S1\))", at);
  at = find_call(calls, "device_malloc", at);
  at = find_call(calls, "comm_init_rank", at);
  CHECK(at >= 0);
  // The op: grouped, on the group's stream, an event recorded behind it.
  at = find_call(calls, "group_start", at);
  at = find_call(calls, R"(all_reduce\(S1\))", at);
  at = find_call(calls, "group_end", at);
  at = find_call(calls, R"(event_record\(E\d+,S1\))", at);
  CHECK(at >= 0);
  // Tear-down: the communicator is finalized and destroyed, then the stream.
  at = find_call(calls, "comm_finalize", at);
  at = find_call(calls, "comm_destroy", at);
  at = find_call(calls, "device_free", at);
  at = find_call(calls, R"(stream_destroy\(S1\))", at);
  CHECK(at >= 0);
  CHECK(api.aborts == 0);
  CHECK(api.concurrent == 0);
  CHECK(api.after_abort == 0);
}

TEST_CASE("nccl streams: the op waits for the caller's legacy stream, wait() orders it back",
          "[unit]") {
  FakeApi api;
  api.ready_after = 0;
  float data[4] = {};
  auto backend = fake_backend(api);

  // Blocking, no StreamGuard: an event recorded on the legacy default stream
  // (which waits for every blocking stream) holds the group's stream back
  // until the caller's earlier work is done; the caller's stream waits for an
  // event recorded after the op.
  auto before = static_cast<long>(api.calls().size());
  backend->run(all_reduce_op(data, 4, 0), /*async=*/false);
  {
    const auto calls = api.calls();
    INFO(joined(calls));
    std::smatch ready, done;
    const long recorded = find_call(calls, R"(event_record\((E\d+),legacy\))", before, &ready);
    REQUIRE(recorded >= 0);
    const long held = find_call(calls, R"(stream_wait_event\(S1,)" + ready[1].str() + R"(\))");
    const long op = find_call(calls, R"(all_reduce\(S1\))", before);
    const long after = find_call(calls, R"(event_record\((E\d+),S1\))", op, &done);
    REQUIRE(after >= 0);
    const long released =
        find_call(calls, R"(stream_wait_event\(legacy,)" + done[1].str() + R"(\))", after);
    CHECK(held > recorded);
    CHECK(op > held);
    CHECK(after > op);
    CHECK(released > after);
  }

  // Async: the caller's stream is ordered after the op in wait(), not before.
  before = static_cast<long>(api.calls().size());
  auto work = backend->run(all_reduce_op(data, 4, 0), /*async=*/true);
  CHECK(find_call(api.calls(), R"(event_record\(E\d+,legacy\))", before) >= 0);
  CHECK(find_call(api.calls(), R"(stream_wait_event\(legacy,E\d+\))", before) < 0);
  work->wait();
  CHECK(find_call(api.calls(), R"(stream_wait_event\(legacy,E\d+\))", before) >= 0);

  // Under a StreamGuard the op is on the caller's stream itself: nothing to
  // order, and the legacy stream is left alone.
  auto* user = reinterpret_cast<CUstream_st*>(uintptr_t{0x7001});
  before = static_cast<long>(api.calls().size());
  {
    dist::StreamGuard guard(user);
    work = backend->run(all_reduce_op(data, 4, 0), /*async=*/false);
  }
  {
    const auto calls = api.calls();
    INFO(joined(calls));
    CHECK(find_call(calls, R"(all_reduce\(U1\))", before) >= 0);
    CHECK(find_call(calls, R"(event_record\(E\d+,U1\))", before) >= 0);
    CHECK(find_call(calls, R"(event_record\(E\d+,legacy\))", before) < 0);
    CHECK(find_call(calls, R"(stream_wait_event\(.*\))", before) < 0);
  }
  // Waited for from a thread without a guard, the op orders that thread's
  // (legacy) stream.
  before = static_cast<long>(api.calls().size());
  {
    dist::StreamGuard guard(user);
    work = backend->run(all_reduce_op(data, 4, 0), /*async=*/true);
  }
  work->wait();
  CHECK(find_call(api.calls(), R"(stream_wait_event\(legacy,E\d+\))", before) >= 0);
  CHECK(api.concurrent == 0);
}

TEST_CASE("nccl device: every call gives the caller's current device back", "[unit]") {
  FakeApi api;
  api.ready_after = 0;
  float data[4] = {};
  api.set_device(1);  // the caller works on cuda:1, the group on cuda:0
  {
    auto backend = fake_backend(api, 0);
    CHECK(api.device() == 1);
    backend->run(all_reduce_op(data, 4, 0), /*async=*/false);
    CHECK(api.device() == 1);
    auto work = backend->run(all_reduce_op(data, 4, 0), /*async=*/true);
    CHECK(api.device() == 1);
    work->wait();
    CHECK(api.device() == 1);
  }
  CHECK(api.device() == 1);                                  // the group's destructor
  CHECK(find_call(api.calls(), R"(set_device\(0\))") >= 0);  // it did work on cuda:0
  // A failed set-up too.
  api.init_result = ncclSystemError;
  CHECK_THROWS_AS(fake_backend(api, 0), ctorchrun::IoError);
  CHECK(api.device() == 1);

  // A thread that never chose a device (CUDA says 0, without a context) is
  // not moved back to cuda:0: that would make a context there, in every
  // rank's process.
  FakeApi fresh;
  fresh.ready_after = 0;
  {
    auto backend = fake_backend(fresh, 1);
    backend->run(all_reduce_op(data, 4, 1), /*async=*/false);
  }
  CHECK(find_call(fresh.calls(), R"(set_device\(0\))") < 0);
  CHECK_FALSE(fresh.has_context(0));
}

TEST_CASE("nccl abort: never while a call is inside the communicator, none after it", "[unit]") {
  // Another thread is inside the communicator (enqueueing an all_reduce, or
  // polling its asynchronous error) when a timed-out op aborts it: the abort
  // waits for it, and that thread's op then fails cleanly with IoError.
  for (const std::string blocking : {"all_reduce(S1)", "comm_get_async_error"}) {
    INFO("blocked inside " << blocking);
    FakeApi api;  // events never complete: a stalled stream
    float a[4] = {}, b[4] = {};
    auto backend = fake_backend(api);
    // Its own timeout passes at once: waiting for it aborts the communicator.
    auto stalled = backend->run(all_reduce_op(a, 4, 0, milliseconds(1)), /*async=*/true);

    std::mutex mutex;
    std::condition_variable changed;
    std::thread::id holder;
    bool held = false, inside = false, other_entered = false;
    api.hook = [&](const std::string& call) {
      std::unique_lock<std::mutex> lock(mutex);
      if (call == blocking && std::this_thread::get_id() == holder && !held) {
        held = inside = true;
        changed.notify_all();
        // Stays inside long enough for an unguarded abort to come in.
        changed.wait_for(lock, milliseconds(500), [&] { return other_entered; });
        inside = false;
      } else if (inside) {
        other_entered = true;
        changed.notify_all();
      }
    };
    std::string outcome = "none";
    std::thread user([&] {
      {
        std::lock_guard<std::mutex> lock(mutex);
        holder = std::this_thread::get_id();
      }
      try {
        backend->run(all_reduce_op(b, 4, 0, milliseconds(20000)), /*async=*/false);
        outcome = "completed";
      } catch (const ctorchrun::IoError& e) {
        outcome = std::string("IoError: ") + e.what();
      } catch (const std::exception& e) {
        outcome = std::string("other: ") + e.what();
      }
    });
    {
      std::unique_lock<std::mutex> lock(mutex);
      CHECK(changed.wait_for(lock, milliseconds(10000), [&] { return held; }));
    }
    CHECK_THROWS_AS(stalled->wait(), ctorchrun::TimeoutError);
    user.join();
    INFO(joined(api.calls()));
    CHECK(api.concurrent == 0);
    CHECK_FALSE(other_entered);
    CHECK(api.aborts == 1);
    CHECK_THAT(outcome, Catch::StartsWith("IoError: ") && Catch::Contains("aborted"));
    // The group is unusable: later ops fail without entering NCCL.
    CHECK_THROWS_AS(backend->run(all_reduce_op(b, 4, 0), /*async=*/false), ctorchrun::IoError);
    CHECK(api.after_abort == 0);
    api.hook = nullptr;
  }
}
