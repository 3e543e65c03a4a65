// libctorch_dist without the network: conversions, reductions, SHA-256,
// argument checking, checkpoint files.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "collectives/checkpoint.h"
#include "collectives/process_group.h"
#include "collectives/reduce_kernels.h"
#include "collectives/sha256.h"
#include "common/error.h"
#include "store/hash_store.h"

namespace dist = ctorchrun::dist;
using dist::DataType;
using dist::ReduceOp;

namespace {

struct TempDir {
  TempDir() {
    char pattern[] = "/tmp/ctorch_dist_test.XXXXXX";
    path = ::mkdtemp(pattern);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string path;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void spit(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

std::shared_ptr<dist::ProcessGroup> single_rank_group() {
  dist::InitOptions options;
  options.rank = 0;
  options.world_size = 1;
  options.restart_count = 0;
  options.store = std::make_shared<ctorchrun::store::HashStore>();
  return dist::init_process_group(options);
}

}  // namespace

TEST_CASE("dist types: half converts with round to nearest even", "[unit]") {
  CHECK(dist::float_to_half(1.0f) == 0x3c00);
  CHECK(dist::float_to_half(-2.0f) == 0xc000);
  CHECK(dist::float_to_half(65504.0f) == 0x7bff);
  CHECK(dist::float_to_half(65520.0f) == 0x7c00);               // rounds up to infinity
  CHECK(dist::float_to_half(1.0f + 0x1.0p-11f) == 0x3c00);      // tie, to even
  CHECK(dist::float_to_half(1.0f + 3 * 0x1.0p-11f) == 0x3c02);  // tie, to even (up)
  CHECK(dist::float_to_half(0x1.0p-24f) == 0x0001);             // smallest subnormal
  CHECK(dist::float_to_half(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK((dist::float_to_half(std::nanf("")) & 0x7c00) == 0x7c00);
  for (uint32_t bits = 0; bits < 0x7c00; ++bits) {  // every finite half round-trips
    const auto h = static_cast<uint16_t>(bits);
    REQUIRE(dist::float_to_half(dist::half_to_float(h)) == h);
  }
}

TEST_CASE("dist types: bfloat16 converts with round to nearest even", "[unit]") {
  CHECK(dist::float_to_bfloat16(1.0f) == 0x3f80);
  CHECK(dist::bfloat16_to_float(0x3f80) == 1.0f);
  CHECK(dist::float_to_bfloat16(1.0f + 0x1.0p-8f) == 0x3f80);      // tie, to even
  CHECK(dist::float_to_bfloat16(1.0f + 3 * 0x1.0p-8f) == 0x3f82);  // tie, to even (up)
  CHECK(dist::float_to_bfloat16(256.0f) == 0x4380);
  CHECK(dist::bfloat16_to_float(dist::float_to_bfloat16(81.0f)) == 81.0f);
}

TEST_CASE("dist kernels: reductions of every type, in place", "[unit]") {
  {
    std::vector<int8_t> a = {1, -5, 3}, b = {2, 7, -4};
    dist::detail::reduce_function(DataType::kInt8, ReduceOp::kProduct)(a.data(), a.data(), b.data(),
                                                                       a.size());
    CHECK(a == std::vector<int8_t>{2, -35, -12});
  }
  {
    std::vector<uint16_t> a = {dist::float_to_bfloat16(1.5f), dist::float_to_bfloat16(-3.0f)};
    std::vector<uint16_t> b = {dist::float_to_bfloat16(2.0f), dist::float_to_bfloat16(4.0f)};
    dist::detail::reduce_function(DataType::kBFloat16, ReduceOp::kSum)(a.data(), a.data(), b.data(),
                                                                       a.size());
    CHECK(dist::bfloat16_to_float(a[0]) == 3.5f);
    CHECK(dist::bfloat16_to_float(a[1]) == 1.0f);
    dist::detail::divide_in_place(a.data(), a.size(), DataType::kBFloat16, 2);
    CHECK(dist::bfloat16_to_float(a[0]) == 1.75f);
  }
  {
    std::vector<uint16_t> a = {dist::float_to_half(2.0f)}, b = {dist::float_to_half(-7.0f)};
    dist::detail::reduce_function(DataType::kFloat16, ReduceOp::kMin)(a.data(), a.data(), b.data(),
                                                                      1);
    CHECK(dist::half_to_float(a[0]) == -7.0f);
  }
  {
    std::vector<int64_t> a = {int64_t{1} << 40, 3}, b = {5, int64_t{1} << 41};
    dist::detail::reduce_function(DataType::kInt64, ReduceOp::kMax)(a.data(), a.data(), b.data(),
                                                                    2);
    CHECK(a == std::vector<int64_t>{int64_t{1} << 40, int64_t{1} << 41});
  }
}

// A NaN on either side survives min and max, so that paths combining the
// ranks in different orders (gloo's ring, shared memory, hierarchical) agree.
TEST_CASE("dist kernels: min and max pass a NaN on from either side, for every float type",
          "[unit]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DataType dtype :
       {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16}) {
    for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
      CAPTURE(dist::to_string(dtype), static_cast<int>(op));
      const auto fn = dist::detail::reduce_function(dtype, op);
      // [x, NaN, 1, NaN] against [NaN, x, NaN, 2]: every element has a NaN.
      auto encode = [&](std::vector<double> values) {
        std::vector<uint8_t> bytes(values.size() * dist::element_size(dtype));
        for (size_t i = 0; i < values.size(); ++i) {
          const auto v = static_cast<float>(values[i]);
          switch (dtype) {
            case DataType::kFloat32:
              std::memcpy(bytes.data() + 4 * i, &v, 4);
              break;
            case DataType::kFloat64:
              std::memcpy(bytes.data() + 8 * i, &values[i], 8);
              break;
            default: {
              const uint16_t h =
                  dtype == DataType::kFloat16 ? dist::float_to_half(v) : dist::float_to_bfloat16(v);
              std::memcpy(bytes.data() + 2 * i, &h, 2);
            }
          }
        }
        return bytes;
      };
      auto a = encode({3.0, nan, 1.0, nan});
      const auto b = encode({nan, 3.0, nan, 2.0});
      fn(a.data(), a.data(), b.data(), 4);
      for (size_t i = 0; i < 4; ++i) {
        double got = 0;
        switch (dtype) {
          case DataType::kFloat32: {
            float f;
            std::memcpy(&f, a.data() + 4 * i, 4);
            got = f;
            break;
          }
          case DataType::kFloat64:
            std::memcpy(&got, a.data() + 8 * i, 8);
            break;
          default: {
            uint16_t h;
            std::memcpy(&h, a.data() + 2 * i, 2);
            got = dtype == DataType::kFloat16 ? dist::half_to_float(h) : dist::bfloat16_to_float(h);
          }
        }
        CHECK(std::isnan(got));
      }
    }
  }
  // Without NaN nothing changes.
  std::vector<float> x = {1.0f, -2.0f}, y = {0.5f, 4.0f};
  dist::detail::reduce_function(DataType::kFloat32, ReduceOp::kMin)(x.data(), x.data(), y.data(),
                                                                    2);
  CHECK(x == std::vector<float>{0.5f, -2.0f});
}

TEST_CASE("dist sha256: FIPS 180-4 test vectors", "[unit]") {
  CHECK(dist::sha256_hex("", 0) ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(dist::sha256_hex("abc", 3) ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  CHECK(dist::sha256_hex(two_blocks.data(), two_blocks.size()) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  dist::Sha256 pieces;  // fed in uneven pieces
  for (size_t at = 0; at < million.size(); at += 997) {
    pieces.update(million.data() + at, std::min<size_t>(997, million.size() - at));
  }
  auto digest = pieces.finish();
  CHECK(dist::to_hex(digest.data(), digest.size()) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("dist process group: a single rank runs every op and checks arguments", "[unit]") {
  auto pg = single_rank_group();
  CHECK(pg->rank() == 0);
  CHECK(pg->size() == 1);
  CHECK(pg->backend_name() == "gloo");
  std::vector<float> f = {1.5f, 2.5f};
  pg->all_reduce(dist::make_buffer(f.data(), f.size()), ReduceOp::kAverage);
  CHECK(f == std::vector<float>{1.5f, 2.5f});
  std::vector<float> out(2);
  pg->all_gather(dist::make_buffer(f.data(), 2), dist::make_buffer(out.data(), 2));
  CHECK(out == f);
  pg->barrier_async()->wait();

  std::vector<int32_t> ints = {1, 2};
  auto ib = dist::make_buffer(ints.data(), ints.size());
  CHECK_THROWS_AS(pg->all_reduce(ib, ReduceOp::kAverage), ctorchrun::ConfigError);
  CHECK_THROWS_WITH(pg->all_reduce(ib, ReduceOp::kAverage),
                    Catch::Contains("average is defined for floating types only"));
  CHECK_THROWS_AS(pg->reduce_scatter(ib, ib, ReduceOp::kAverage), ctorchrun::ConfigError);
  CHECK_THROWS_WITH(pg->broadcast(ib, 1), Catch::Contains("root 1 is not a rank"));
  std::vector<int32_t> small(1);
  CHECK_THROWS_WITH(pg->all_gather(ib, dist::make_buffer(small.data(), 1)),
                    Catch::Contains("needs 2"));
  CHECK_THROWS_WITH(pg->send(ib, 0), Catch::Contains("itself"));
  auto cuda = ib;
  cuda.device = dist::Device{dist::DeviceType::kCuda, 0};
  CHECK_THROWS_WITH(pg->all_reduce(cuda), Catch::Contains("cuda:0"));
  std::vector<double> d(2);
  CHECK_THROWS_WITH(pg->all_gather(dist::make_buffer(d.data(), 1), ib),
                    Catch::Contains("input is float64 but output is int32"));
  dist::Buffer null_buffer{nullptr, 3, DataType::kFloat32, {}};
  CHECK_THROWS_WITH(pg->all_reduce(null_buffer), Catch::Contains("null"));

  auto sub = pg->new_group({0});
  REQUIRE(sub != nullptr);
  CHECK(sub->size() == 1);
  CHECK_THROWS_AS(pg->new_group({0, 0}), ctorchrun::ConfigError);
  CHECK_THROWS_AS(pg->new_group({1}), ctorchrun::ConfigError);
}

TEST_CASE("dist process group: unknown backends and CUDA devices on gloo are refused", "[unit]") {
  dist::InitOptions options;
  options.rank = 0;
  options.world_size = 1;
  options.store = std::make_shared<ctorchrun::store::HashStore>();
  options.backend = "mpi";
  CHECK_THROWS_WITH(dist::init_process_group(options),
                    Catch::Contains("unknown process group backend 'mpi'"));
  options.backend = "gloo";
  options.device = dist::Device{dist::DeviceType::kCuda, 0};
  CHECK_THROWS_WITH(dist::init_process_group(options), Catch::Contains("needs the nccl backend"));
  options.device = {};
  options.rank = 2;
  CHECK_THROWS_AS(dist::init_process_group(options), ctorchrun::ConfigError);
}

TEST_CASE("dist process group: CTORCHRUN_DIST_CHECK_CALLS must be 0 or 1", "[unit]") {
  dist::InitOptions options;
  options.rank = 0;
  options.world_size = 1;
  options.store = std::make_shared<ctorchrun::store::HashStore>();
  ::setenv("CTORCHRUN_DIST_CHECK_CALLS", "yes", 1);
  CHECK_THROWS_WITH(dist::init_process_group(options),
                    Catch::Contains("CTORCHRUN_DIST_CHECK_CALLS='yes' must be 0 (off) or 1 (on)"));
  options.check_calls = true;  // the option wins over the variable
  CHECK_NOTHROW(dist::init_process_group(options));
  options.check_calls.reset();
  ::setenv("CTORCHRUN_DIST_CHECK_CALLS", "0", 1);
  CHECK_NOTHROW(dist::init_process_group(options));
  ::unsetenv("CTORCHRUN_DIST_CHECK_CALLS");
}

TEST_CASE("dist process group: keys live under /ctorch_dist/attempt_<k>/", "[unit]") {
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  dist::InitOptions options;
  options.rank = 0;
  options.world_size = 1;
  options.restart_count = 4;
  options.store = store;
  auto pg = dist::init_process_group(options);
  // HashStore holds keys as given; PrefixStore joined them under our prefix.
  int ours = 0;
  for (int n = 0; n < 1000 && ours == 0; ++n) {
    if (store->check({"ctorch_dist/attempt_4/pg_" + std::to_string(n) + "/arrived/0"})) ++ours;
  }
  CHECK(ours == 1);
}

TEST_CASE("dist checkpoint: save, list, load the latest, keep the last K", "[unit]") {
  TempDir dir;
  CHECK_FALSE(dist::load_latest_checkpoint(dir.path).has_value());
  for (int step = 0; step < 5; ++step) {
    dist::save_checkpoint(dir.path, step, "payload " + std::to_string(step), 3);
  }
  CHECK(dist::list_checkpoints(dir.path) == std::vector<int64_t>{2, 3, 4});
  auto latest = dist::load_latest_checkpoint(dir.path);
  REQUIRE(latest.has_value());
  CHECK(latest->step == 4);
  CHECK(latest->payload == "payload 4");
  std::string binary("\0\1\2\xff", 4);
  dist::save_checkpoint(dir.path, 9, binary);
  CHECK(dist::load_latest_checkpoint(dir.path)->payload == binary);
  // Nothing but checkpoints is left behind (no temporary files), beside the
  // writer's lock file.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path)) {
    const std::string name = entry.path().filename().string();
    if (name == ".ctckpt-lock") continue;
    CHECK(name.rfind("ckpt-", 0) == 0);
    ++files;
  }
  CHECK(files == 4);
}

TEST_CASE("dist checkpoint: truncated, torn and corrupted files are skipped, never loaded",
          "[unit]") {
  TempDir dir;
  dist::save_checkpoint(dir.path, 1, std::string(1000, 'a'));
  const std::string good = slurp(dist::checkpoint_path(dir.path, 1));
  const std::string two = dist::checkpoint_path(dir.path, 2);
  std::string why;

  SECTION("truncated") {
    dist::save_checkpoint(dir.path, 2, std::string(1000, 'b'));
    const std::string full = slurp(two);
    spit(two, full.substr(0, full.size() - 1));
    CHECK_FALSE(dist::load_checkpoint(two, &why).has_value());
    CHECK_THAT(why, Catch::Contains("truncated"));
    spit(two, full.substr(0, 10));
    CHECK_FALSE(dist::load_checkpoint(two, &why).has_value());
  }
  SECTION("torn: the start of a new file over the tail of an old one") {
    dist::save_checkpoint(dir.path, 2, std::string(1000, 'b'));
    std::string torn = slurp(two);
    std::memcpy(&torn[0] + 500, good.data() + 500, 400);  // half the pages are stale
    spit(two, torn);
    CHECK_FALSE(dist::load_checkpoint(two, &why).has_value());
    CHECK_THAT(why, Catch::Contains("checksum"));
  }
  SECTION("corrupted: one bit flipped") {
    dist::save_checkpoint(dir.path, 2, std::string(1000, 'b'));
    std::string bad = slurp(two);
    bad[700] = static_cast<char>(bad[700] ^ 0x10);
    spit(two, bad);
    CHECK_FALSE(dist::load_checkpoint(two, &why).has_value());
    CHECK_THAT(why, Catch::Contains("checksum"));
  }
  SECTION("garbage and an empty file") {
    spit(two, "not a checkpoint at all, but long enough to have a header and a trailer");
    CHECK_FALSE(dist::load_checkpoint(two, &why).has_value());
    CHECK_THAT(why, Catch::Contains("magic"));
    spit(dist::checkpoint_path(dir.path, 3), "");
  }
  SECTION("a file renamed to another step") { spit(two, good); }
  // A temporary file of a save that died is never taken for a checkpoint.
  spit(dir.path + "/.tmp-12345-ckpt-000000000007.ctckpt", good);
  auto latest = dist::load_latest_checkpoint(dir.path);
  REQUIRE(latest.has_value());
  CHECK(latest->step == 1);
  CHECK(latest->payload == std::string(1000, 'a'));
}

TEST_CASE(
    "dist process group: init ignores SIGPIPE (a dead peer fails an op, never kills) unless the "
    "program chose its own action",
    "[unit]") {
  struct sigaction saved {};
  REQUIRE(::sigaction(SIGPIPE, nullptr, &saved) == 0);
  ::signal(SIGPIPE, SIG_DFL);
  auto pg = single_rank_group();
  struct sigaction now {};
  REQUIRE(::sigaction(SIGPIPE, nullptr, &now) == 0);
  CHECK(now.sa_handler == SIG_IGN);
  // A program's own choice stays.
  ::signal(SIGPIPE, SIG_DFL);
  struct sigaction mine {};
  mine.sa_handler = [](int) {};
  ::sigaction(SIGPIPE, &mine, nullptr);
  auto again = single_rank_group();
  REQUIRE(::sigaction(SIGPIPE, nullptr, &now) == 0);
  CHECK(now.sa_handler == mine.sa_handler);
  ::sigaction(SIGPIPE, &saved, nullptr);
}

TEST_CASE("dist work: when_complete runs on the completing thread, or at once when done",
          "[unit]") {
  auto work = std::make_shared<dist::PromiseWork>("an op");
  std::vector<std::string> seen;
  dist::when_complete(work, [&](std::exception_ptr e) { seen.push_back(e ? "error" : "first"); });
  dist::when_complete(work, [&](std::exception_ptr e) { seen.push_back(e ? "error" : "second"); });
  CHECK(seen.empty());
  std::thread finisher([&] { work->finish(nullptr); });
  finisher.join();
  CHECK(seen == std::vector<std::string>{"first", "second"});
  // Registered after completion: runs at once, here.
  dist::when_complete(work, [&](std::exception_ptr e) { seen.push_back(e ? "error" : "late"); });
  CHECK(seen.back() == "late");
  // A throwing callback is dropped (and logged); the others still run.
  auto failed = std::make_shared<dist::PromiseWork>("a failing op");
  std::string what;
  dist::when_complete(failed, [](std::exception_ptr) { throw std::runtime_error("bug"); });
  dist::when_complete(failed, [&](std::exception_ptr e) {
    try {
      std::rethrow_exception(e);
    } catch (const ctorchrun::IoError& err) {
      what = err.what();
    }
  });
  failed->finish(std::make_exception_ptr(ctorchrun::IoError("peer died")));
  CHECK(what == "peer died");
}

TEST_CASE("dist work: when_complete waits on a thread of its own for a Work that is no PromiseWork",
          "[unit]") {
  struct SlowWork : dist::Work {
    std::atomic<bool> done{false};
    void wait() override {
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    void wait(std::chrono::milliseconds) override { wait(); }
    bool is_completed() override { return done; }
  };
  auto work = std::make_shared<SlowWork>();
  std::promise<std::thread::id> ran;
  dist::when_complete(work, [&](std::exception_ptr) { ran.set_value(std::this_thread::get_id()); });
  auto result = ran.get_future();
  CHECK(result.wait_for(std::chrono::milliseconds(50)) == std::future_status::timeout);
  work->done = true;
  REQUIRE(result.wait_for(std::chrono::seconds(5)) == std::future_status::ready);
  CHECK(result.get() != std::this_thread::get_id());
}

TEST_CASE("dist process group: join_process_group builds a group over a store as given", "[unit]") {
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  auto pg = dist::join_process_group(store, 0, 1, "torch/group_7");
  CHECK(pg->rank() == 0);
  CHECK(pg->size() == 1);
  CHECK(store->check({"arrived/0"}));  // its keys go straight into the given store
  std::vector<float> data{1.5f, 2.5f};
  pg->all_reduce(dist::make_buffer(data.data(), data.size()), dist::ReduceOp::kAverage);
  CHECK(data == std::vector<float>{1.5f, 2.5f});
  CHECK_THROWS_AS(dist::join_process_group(store, 1, 1, "bad"), ctorchrun::ConfigError);
  CHECK_THROWS_AS(dist::join_process_group(nullptr, 0, 1, "none"), ctorchrun::ConfigError);
}

TEST_CASE("dist process group: CTORCHRUN_DIST_SHM_SPIN_US must be a bounded count of microseconds",
          "[unit]") {
  dist::InitOptions options;
  options.rank = 0;
  options.world_size = 1;
  options.store = std::make_shared<ctorchrun::store::HashStore>();
  // atoi took these: "abc" as 0, " 5" as 5, and a day's spin as it was.
  for (const char* bad : {"abc", "-1", " 5", "86400000000", "100001"}) {
    CAPTURE(bad);
    ::setenv("CTORCHRUN_DIST_SHM_SPIN_US", bad, 1);
    CHECK_THROWS_WITH(dist::init_process_group(options),
                      Catch::Contains("CTORCHRUN_DIST_SHM_SPIN_US='" + std::string(bad) +
                                      "' must be a count of microseconds from 0 to 100000"));
  }
  for (const char* good : {"0", "50", "100000"}) {
    ::setenv("CTORCHRUN_DIST_SHM_SPIN_US", good, 1);
    CHECK_NOTHROW(dist::init_process_group(options));
  }
  ::unsetenv("CTORCHRUN_DIST_SHM_SPIN_US");
}
