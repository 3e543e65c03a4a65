// The nccl backend without a GPU: the unique id exchange through the store,
// argument checks, the error mapping, and the completion / abort-on-timeout
// logic driven through a replaced Api (a stalled stream, asynchronous NCCL
// errors) instead of a device.

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
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
// queries (never when negative), an async error state, counted aborts.
class FakeApi : public detail::Api {
 public:
  ncclResult_t get_unique_id(ncclUniqueId* id) override {
    for (size_t i = 0; i < sizeof id->internal; ++i) id->internal[i] = static_cast<char>(i * 7 + 3);
    ++ids;
    return id_result;
  }
  cudaError_t event_query(cudaEvent_t) override {
    ++queries;
    if (event_error != cudaSuccess) return event_error;
    if (ready_after < 0 || queries <= ready_after) return cudaErrorNotReady;
    return cudaSuccess;
  }
  ncclResult_t comm_get_async_error(ncclComm_t, ncclResult_t* error) override {
    ++async_queries;
    *error =
        (in_progress_for < 0 || async_queries <= in_progress_for) ? ncclInProgress : async_error;
    if (in_progress_for == 0) *error = async_error;
    return ncclSuccess;
  }
  ncclResult_t comm_abort(ncclComm_t) override {
    ++aborts;
    return ncclSuccess;
  }
  cudaError_t event_destroy(cudaEvent_t) override {
    ++destroyed;
    return cudaSuccess;
  }

  int ready_after = -1;
  int in_progress_for = 0;
  ncclResult_t async_error = ncclSuccess;
  cudaError_t event_error = cudaSuccess;
  ncclResult_t id_result = ncclSuccess;
  std::atomic<int> ids{0}, queries{0}, async_queries{0}, aborts{0}, destroyed{0};
};

const cudaEvent_t kEvent = reinterpret_cast<cudaEvent_t>(uintptr_t{1});

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
    detail::EventWork work(comm, kEvent, milliseconds(200), "all_reduce on rank 0/1");
    CHECK_FALSE(work.is_completed());
    CHECK_THROWS_WITH(work.wait(milliseconds(10)), Catch::Contains("gave up"));
    CHECK(api.aborts == 0);
    CHECK_THROWS_WITH(work.wait(), Catch::Contains("within 200 ms"));
    CHECK(api.aborts == 1);
    CHECK(work.is_completed());
    CHECK_THROWS_AS(work.wait(), ctorchrun::TimeoutError);  // the same error again
    CHECK(api.aborts == 1);
  }
  CHECK(api.destroyed == 1);
  // Ops started after the abort fail at once.
  detail::EventWork later(comm, kEvent, milliseconds(100000), "barrier on rank 0/1");
  CHECK_THROWS_AS(later.wait(), ctorchrun::IoError);
}

TEST_CASE("nccl work: a completed event completes the work", "[unit]") {
  FakeApi api;
  api.ready_after = 2;
  auto comm = std::make_shared<detail::Communicator>(api, nullptr);
  detail::EventWork work(comm, kEvent, milliseconds(100000), "broadcast on rank 0/1");
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
