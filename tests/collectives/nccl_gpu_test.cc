// The nccl backend on a GPU (label gpu; scripts/test.sh leaves these out by
// name on machines without one): the op matrix at world size 1, the trainer's
// clean and crash-resume runs under ctorchrun, timeouts that abort the
// communicator, and ops ordered after the caller's work on stream 0. NCCL
// refuses two ranks on one device, so multi-rank runs need a machine with
// several GPUs; the multi-rank logic (store, groups, argument checks) is
// ProcessGroup's, shared with gloo and tested there.

#include <cuda_runtime_api.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "collectives/nccl/nccl_backend.h"
#include "collectives/process_group.h"
#include "common/error.h"
#include "store/hash_store.h"
#include "tests/launcher/launcher_support.h"
#include "tests/support/process.h"

namespace dist = ctorchrun::dist;
using namespace ctorchrun::testing;
using std::chrono::milliseconds;
using std::chrono::seconds;

namespace {

void cuda(cudaError_t r) {
  INFO(cudaGetErrorString(r));
  REQUIRE(r == cudaSuccess);
}

std::shared_ptr<dist::ProcessGroup> gpu_group(milliseconds timeout = dist::kDefaultTimeout) {
  dist::register_nccl_backend();
  int devices = 0;
  cuda(cudaGetDeviceCount(&devices));
  REQUIRE(devices >= 1);
  dist::InitOptions options;
  options.backend = "nccl";
  options.rank = 0;
  options.world_size = 1;
  options.restart_count = 0;
  options.device = {dist::DeviceType::kCuda, 0};
  options.store = std::make_shared<ctorchrun::store::HashStore>();
  options.timeout = timeout;
  return dist::init_process_group(options);
}

// Host bytes of `count` small integers (1 + i % 7) in `dtype`.
std::vector<unsigned char> values(dist::DataType dtype, size_t count) {
  std::vector<unsigned char> bytes(count * dist::element_size(dtype));
  for (size_t i = 0; i < count; ++i) {
    const float v = static_cast<float>(1 + i % 7);
    unsigned char* at = bytes.data() + i * dist::element_size(dtype);
    auto put = [&](auto x) { std::memcpy(at, &x, sizeof x); };
    switch (dtype) {
      case dist::DataType::kFloat32:
        put(v);
        break;
      case dist::DataType::kFloat64:
        put(static_cast<double>(v));
        break;
      case dist::DataType::kFloat16:
        put(dist::float_to_half(v));
        break;
      case dist::DataType::kBFloat16:
        put(dist::float_to_bfloat16(v));
        break;
      case dist::DataType::kInt8:
        put(static_cast<int8_t>(v));
        break;
      case dist::DataType::kUInt8:
        put(static_cast<uint8_t>(v));
        break;
      case dist::DataType::kInt32:
        put(static_cast<int32_t>(v));
        break;
      case dist::DataType::kInt64:
        put(static_cast<int64_t>(v));
        break;
    }
  }
  return bytes;
}

struct DeviceBuffer {
  DeviceBuffer(const std::vector<unsigned char>& host, size_t count, dist::DataType dtype) {
    cuda(cudaMalloc(&data, host.size() + 1));
    cuda(cudaMemcpy(data, host.data(), host.size(), cudaMemcpyHostToDevice));
    buffer = dist::Buffer{data, count, dtype, {dist::DeviceType::kCuda, 0}};
  }
  ~DeviceBuffer() { cudaFree(data); }
  std::vector<unsigned char> read() const {
    std::vector<unsigned char> host(buffer.bytes());
    cuda(cudaMemcpy(host.data(), data, host.size(), cudaMemcpyDeviceToHost));
    return host;
  }
  void* data = nullptr;
  dist::Buffer buffer;
};

}  // namespace

TEST_CASE("nccl gpu matrix: every op, data type and reduce op at world size 1", "[gpu]") {
  auto pg = gpu_group();
  const size_t n = 1000;
  int checks = 0;
  for (auto dtype : {dist::DataType::kFloat32, dist::DataType::kFloat64, dist::DataType::kFloat16,
                     dist::DataType::kBFloat16, dist::DataType::kInt8, dist::DataType::kUInt8,
                     dist::DataType::kInt32, dist::DataType::kInt64}) {
    const auto host = values(dtype, n);
    const auto zeros = std::vector<unsigned char>(host.size(), 0);
    INFO(dist::to_string(dtype));
    // At world size 1 every op leaves (or copies) the rank's own data.
    for (auto op : {dist::ReduceOp::kSum, dist::ReduceOp::kProduct, dist::ReduceOp::kMin,
                    dist::ReduceOp::kMax, dist::ReduceOp::kAverage}) {
      if (op == dist::ReduceOp::kAverage && !dist::is_floating(dtype)) continue;
      INFO(dist::to_string(op));
      DeviceBuffer a(host, n, dtype);
      pg->all_reduce(a.buffer, op);
      CHECK(a.read() == host);
      DeviceBuffer r(host, n, dtype);
      pg->reduce(r.buffer, 0, op);
      CHECK(r.read() == host);
      DeviceBuffer in(host, n, dtype), out(zeros, n, dtype);
      pg->reduce_scatter(in.buffer, out.buffer, op);
      CHECK(out.read() == host);
      checks += 3;
    }
    using Call =
        void (dist::ProcessGroup::*)(const dist::Buffer&, const dist::Buffer&, milliseconds);
    for (Call call : {static_cast<Call>(&dist::ProcessGroup::all_gather),
                      static_cast<Call>(&dist::ProcessGroup::all_to_all)}) {
      DeviceBuffer in(host, n, dtype), out(zeros, n, dtype);
      (pg.get()->*call)(in.buffer, out.buffer, dist::kGroupTimeout);
      CHECK(out.read() == host);
      ++checks;
    }
    {
      DeviceBuffer in(host, n, dtype), out(zeros, n, dtype);
      pg->gather(in.buffer, out.buffer, 0);
      CHECK(out.read() == host);
      DeviceBuffer back(zeros, n, dtype);
      pg->scatter(out.buffer, back.buffer, 0);
      CHECK(back.read() == host);
      DeviceBuffer b(host, n, dtype);
      pg->broadcast(b.buffer, 0);
      CHECK(b.read() == host);
      checks += 3;
    }
  }
  pg->barrier();
  CHECK(checks > 100);
}

TEST_CASE("nccl gpu: async ops on the caller's stream, a subgroup of its own", "[gpu]") {
  auto pg = gpu_group();
  const auto host = values(dist::DataType::kFloat32, 4096);
  DeviceBuffer a(host, 4096, dist::DataType::kFloat32);
  cudaStream_t stream = nullptr;
  cuda(cudaStreamCreate(&stream));
  {
    dist::StreamGuard guard(stream);
    CHECK(dist::current_stream_override() == stream);
    auto work = pg->all_reduce_async(a.buffer);
    work->wait();
    CHECK(work->is_completed());
  }
  CHECK(dist::current_stream_override() == nullptr);
  CHECK(a.read() == host);
  auto sub = pg->new_group({0});
  REQUIRE(sub != nullptr);
  CHECK(sub->backend_name() == "nccl");
  sub->all_reduce(a.buffer, dist::ReduceOp::kMax);
  CHECK(a.read() == host);
  // A buffer on another device is refused before NCCL sees it.
  dist::Buffer elsewhere = a.buffer;
  elsewhere.device.index = 7;
  CHECK_THROWS_AS(pg->all_reduce(elsewhere), ctorchrun::ConfigError);
  sub.reset();
  cuda(cudaStreamDestroy(stream));
}

namespace {

// Holds the stream until released, at most about 5 s (ncclCommAbort may wait
// for the device, and so for this function, before it returns).
std::atomic<bool> release{false};
void CUDART_CB hold_stream(void*) {
  for (int i = 0; i < 50000 && !release.load(); ++i) {
    struct timespec pause = {0, 100000};
    nanosleep(&pause, nullptr);
  }
}

}  // namespace

TEST_CASE("nccl gpu timeout: a stalled stream aborts the communicator", "[gpu]") {
  auto pg = gpu_group();
  cudaStream_t stream = nullptr;
  cuda(cudaStreamCreate(&stream));
  release = false;
  // A host function that blocks holds the stream: the op queued behind it
  // never completes within its timeout.
  cuda(cudaLaunchHostFunc(stream, hold_stream, nullptr));
  const auto host = values(dist::DataType::kFloat32, 16);
  DeviceBuffer a(host, 16, dist::DataType::kFloat32);
  {
    dist::StreamGuard guard(stream);
    CHECK_THROWS_AS(pg->all_reduce(a.buffer, dist::ReduceOp::kSum, milliseconds(500)),
                    ctorchrun::TimeoutError);
  }
  release = true;
  CHECK_THROWS_WITH(pg->all_reduce(a.buffer), Catch::Contains("aborted"));
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
}

TEST_CASE("nccl gpu streams: an op sees the input the caller wrote late on stream 0", "[gpu]") {
  auto pg = gpu_group();
  // all_gather at world size 1 copies the input to the output, so the output
  // shows whether NCCL read the input before or after the caller's write (an
  // in-place all_reduce at world size 1 leaves the buffer as it is and could
  // not tell).
  const size_t n = size_t{1} << 22;  // 16 MiB of float32
  const auto host = values(dist::DataType::kFloat32, n);
  const auto zeros = std::vector<unsigned char>(host.size(), 0);
  DeviceBuffer in(zeros, n, dist::DataType::kFloat32), out(zeros, n, dist::DataType::kFloat32);
  pg->all_gather(in.buffer, out.buffer);  // NCCL's lazy set-up happens here, not below
  REQUIRE(out.read() == zeros);
  void* pinned = nullptr;
  cuda(cudaMallocHost(&pinned, host.size()));
  std::memcpy(pinned, host.data(), host.size());

  // The legacy default stream is held, and the caller's write of the input
  // is queued behind: it lands late.
  release = false;
  cuda(cudaLaunchHostFunc(cudaStreamLegacy, hold_stream, nullptr));
  cuda(cudaMemcpyAsync(in.data, pinned, host.size(), cudaMemcpyHostToDevice, cudaStreamLegacy));
  auto work = pg->all_gather_async(in.buffer, out.buffer);
  // Ordered after the write, the op cannot finish while the stream is held
  // (unordered, it has long copied the zeros).
  CHECK_THROWS_AS(work->wait(milliseconds(300)), ctorchrun::TimeoutError);
  release = true;
  work->wait();
  CHECK(out.read() == host);
  cuda(cudaFreeHost(pinned));
}

TEST_CASE("nccl gpu timeout: a rank that never joins aborts the set-up", "[gpu]") {
  dist::register_nccl_backend();
  dist::BackendContext context;
  context.store = std::make_shared<ctorchrun::store::HashStore>();
  context.rank = 0;
  context.size = 2;  // rank 1 never comes
  context.device = {dist::DeviceType::kCuda, 0};
  context.timeout = milliseconds(3000);
  CHECK_THROWS_AS(dist::create_backend("nccl", context), ctorchrun::TimeoutError);
}

namespace {

// The tools next to this test binary: the GPU machine runs a copy of the
// tree, maybe at another path than the one the build recorded.
std::string bin(const std::string& name) {
  return (std::filesystem::canonical("/proc/self/exe").parent_path() / name).string();
}

nlohmann::json train(const std::string& workdir, const std::vector<std::string>& extra_worker,
                     const std::vector<std::string>& extra_launcher) {
  std::vector<std::string> argv = {bin("ctorchrun"), "--nproc_per_node=1",
                                   "--master_port=" + std::to_string(free_port())};
  argv.insert(argv.end(), extra_launcher.begin(), extra_launcher.end());
  argv.insert(argv.end(), {"--no_python", bin("ctorch-train-example"), "--workdir", workdir,
                           "--epochs", "5", "--backend", "nccl"});
  argv.insert(argv.end(), extra_worker.begin(), extra_worker.end());
  Process p(argv, {}, /*capture_stderr=*/true);
  const std::string output = p.read_all(seconds(240));
  const int code = p.exit_code(seconds(10));
  INFO(output);
  REQUIRE(code == 0);
  return nlohmann::json::parse(read_file(workdir + "/result.json"));
}

}  // namespace

TEST_CASE("nccl gpu trainer: clean and crash-resume runs end with the same digest", "[gpu]") {
  TempDir clean, crashed;
  auto a = train(clean.path, {}, {});
  auto b =
      train(crashed.path, {"--fail-once-at-epoch", "3", "--fail-rank", "0"}, {"--max_restarts=1"});
  CHECK(a["attempt"] == 0);
  CHECK(b["attempt"] == 1);
  CHECK(b["start_epoch"] == 3);
  CHECK(a["digest"] == b["digest"]);
}
